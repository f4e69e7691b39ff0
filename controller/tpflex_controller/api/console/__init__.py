"""The operator console: ``/ui`` (static HTML/CSS/JS shipped as package data) and the
``/v1/console/*`` endpoints that feed it (a live stream of the API's watch-fed view)."""
