"""What a user would otherwise write to start a plan on a cluster: a Slurm heterogeneous job
(slurm.py), a Kubernetes JobSet (jobset.py) and one script per host for a cluster without a
scheduler (hosts.py), all around the one agent command of agents.py and its node agent
(node_agent.py), each group in its own Python and environment (environment.py). Pure text from
the cluster, the plan and the flags."""

from hethub.launchers.agents import AgentNode, Launch, agent_nodes
from hethub.launchers.hosts import host_scripts
from hethub.launchers.jobset import jobset_manifest
from hethub.launchers.slurm import slurm_script

__all__ = ["AgentNode", "Launch", "agent_nodes", "host_scripts", "jobset_manifest", "slurm_script"]
