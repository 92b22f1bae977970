"""The HTML report: tables, figures, the published comparison and the failure gallery."""
