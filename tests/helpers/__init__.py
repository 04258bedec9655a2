"""Helpers shared by the tests (imported as the package ``tests.helpers``)."""
