"""The state the cluster shares (worker records, load, KV events): below the workers, the router
and the control plane, which all use it; it imports none of them."""
