"""Scale-out on torch.distributed (gloo on CPU, launched by torchrun)."""
