"""Output for people: bars and tables for the terminal (or plain lines for a log), the loss
plot, and Chrome traces for Perfetto."""
