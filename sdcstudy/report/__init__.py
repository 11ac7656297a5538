"""`sdcstudy report`: run folders as pandas objects, paper-style tables and figures. Imports no
JAX.
"""
