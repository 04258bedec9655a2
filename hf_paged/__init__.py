"""hf_paged: PagedAttention for Hugging Face transformers."""
