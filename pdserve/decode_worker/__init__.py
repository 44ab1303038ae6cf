"""The decode role: reserve blocks, receive a prompt's KV, continue the request from its first token."""
