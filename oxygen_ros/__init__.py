"""oxygen_ros: pi0.5 serving for ROS 2 with unified KV cache management."""
