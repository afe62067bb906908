"""The files a rank opens, as the config names them, and the one check that each is there
(`input_paths.py`); the recipe's shipped corpus (`recipe_corpus.py`)."""
