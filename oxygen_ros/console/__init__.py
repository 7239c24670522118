"""The operator console: a small web page on localhost (oxygen_bringup --console PORT)."""
