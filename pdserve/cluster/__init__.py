"""The control plane: the pdserve CLI, configuration, launching pools, autoscaling, state store."""
