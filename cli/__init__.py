"""The qeff-kv command line (installed as the ``qeff_kv_cli`` package): thin click commands over qeff_kv."""
