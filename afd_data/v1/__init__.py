"""Generated protobuf modules of the data-plane blob (afd.data.v1); regenerate with `make proto`."""
