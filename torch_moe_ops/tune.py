"""``python -m torch_moe_ops.tune --experts E --inter I --hidden H --top-k K``: tune the
Triton experts kernels for one layer shape on this GPU and write the config file
they read (see `torch_moe_ops.backends.triton.tune`)."""

from torch_moe_ops.backends.triton.tune import main

if __name__ == "__main__":
    main()
