"""Entry points (`python launch/main.py ...`); importable as `launch.<script>` from the repository root."""
