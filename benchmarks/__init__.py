"""Benchmarks: kernel (mmjax vs transformers vs roofline), serve (OpenAI load generator), attention."""
