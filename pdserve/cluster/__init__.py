"""The control plane: the pdserve CLI, configuration, launching pools, autoscaling (the state
store they use is pdserve.state)."""
