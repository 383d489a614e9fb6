"""Generated stubs of the ``pjrt_rendezvous.v1`` protocol (do not edit; see scripts/generate_protos.py)."""
