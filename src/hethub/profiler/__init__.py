"""The profiler: measures this machine's layers (the runtime's own modules) and links (real gloo
collectives between processes) with torch, and writes what it measures to the profile store
(hethub.profiles). `measure` on one machine, `cluster` across the nodes of a torchrun job."""
