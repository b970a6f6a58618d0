"""Serving across processes and hosts: the Ray cluster, disaggregated prefill/decode (disagg.py, pd.py), the KV
connector and transfer, prefix-aware routing, replicas and KV events."""
