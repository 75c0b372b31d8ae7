"""Retrieval frontends that make priors: the HotpotQA / SQuAD data and long-context builder
(`data`, `longctx`), kapc's offline hybrid Graph-RAG frontend (`retrieval`, `graph`, `hybrid`),
adapters for other frontends' outputs (`adapters`) and the `kapc prior` commands (`cli`).

Heavy dependencies (bm25s, sentence-transformers, spaCy, igraph) load only when used."""
