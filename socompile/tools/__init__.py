"""Scripts run by hand to produce figures and measurements from real steps (``python -m socompile.tools.<name>``);
nothing in the library imports them."""
