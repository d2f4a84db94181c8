"""The dashboard at /ui: static pages (ui/static/, no build step, charts drawn as SVG by
app.js), the JSON they fetch (views.py) and an incremental index over the records (index.py).
Imports nothing at package level, so appkeys.py can name the index without a cycle."""
