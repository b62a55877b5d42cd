"""What a mask does to the model: evaluation, streaming, generation, embeddings, Linformer, head classes, sinks over a dataset, A-vs-B measures, score attribution, fine-tuning, the walkthrough."""
