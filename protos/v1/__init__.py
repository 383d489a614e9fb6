"""Generated stubs of the ``pjrt_rendezvous.v1`` protocol (do not edit; see protos/pjrt_rendezvous/generate.py)."""
