"""The core's default plugins, registered through the same hooks as any other plugin."""
