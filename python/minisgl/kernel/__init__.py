"""Custom GPU kernels. Each module imports triton itself and is imported only by the backend
that uses it, so this package stays importable on machines without triton."""
