"""Where sections and references come from: 10x downloads, the embedded simulated panel, download helpers."""
