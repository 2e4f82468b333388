"""`cb serve`: an OpenAI-compatible HTTP server over one engine (``pip install 'cbcore[serve]'``).

``build_app`` (``cbcore.serve.app``) gives the FastAPI application; the
engine runs on its own thread (``cbcore.serve.engine_loop``).
"""
