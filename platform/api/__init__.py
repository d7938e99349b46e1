"""HTTP routes, dependencies and error rendering."""
