"""Services: the platform logic the HTTP routes stay thin over."""
