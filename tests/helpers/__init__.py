"""Code that test modules share: clients, an in-process cluster, references, fakes.

Test modules import from here (and use conftest fixtures), never from each other.
"""
