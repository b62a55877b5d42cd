"""What a mask does to the model: evaluation, streaming, generation, embeddings, Linformer, head classes, sinks over a dataset, fine-tuning, the walkthrough."""
