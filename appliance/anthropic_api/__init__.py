"""Anthropic's Messages API (`/v1/messages`) on the same port: an adapter onto the chat path (appliance/api/)."""
