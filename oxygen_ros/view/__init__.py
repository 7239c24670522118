"""Pictures of what the engine sees and decides: the debug image, 3D chunk markers, the web console."""
