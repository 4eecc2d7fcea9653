"""Helpers for the real-browser test (tests/test_browser.py).

``lab_server`` starts and stops a JupyterLab server on a free localhost port; ``lab_page``
drives JupyterLab's notebook page through Playwright (open, run all, find and move a slider).
"""
