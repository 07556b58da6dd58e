"""Llama-family model definitions written for the paged KV cache."""
