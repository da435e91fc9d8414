"""Images in requests: reading them (``images.py``), turning them into a model's patches and
placeholder tokens (``processor.py``), and what a request carries of each (``inputs.py``)."""
