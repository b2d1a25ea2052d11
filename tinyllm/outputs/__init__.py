"""What a run records and makes: metrics, observers, artifacts, evaluation, exports, publishing, the report."""
