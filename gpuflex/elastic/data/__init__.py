"""Data: which samples each member reads at each step (sampler, loader, shares and the
split plan of mixed GPUs), micro-batches, and the gradient reduction over them."""
