"""One module per resource; ``app.create_app`` includes their routers."""
