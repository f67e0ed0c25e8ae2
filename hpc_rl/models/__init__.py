"""Model and tokenizer loading (pad token, dtype, attention), and tiny offline builders."""

from .loading import load_causal_lm, load_tokenizer, torch_dtype  # noqa: F401
