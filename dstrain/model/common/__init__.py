"""What the model families share: kernel choices (kernels.py), attention and its CPU kernel (attention.py), MLA's
projections (mla.py), sparse attention's selection and loss (dsa.py), Kimi Delta Attention, the KDA hybrids'
linear attention (kda.py), routed experts as grouped GEMMs (experts.py), the layers built from them (layers.py),
the chunked cross-entropy head and the losses (loss.py), the forward's output (output.py), LoRA (lora.py), shared
config values (config.py) and the family record (family.py)."""
