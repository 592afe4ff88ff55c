"""experiments/conf/: the SLURM launcher config composes with the train app (needs hydra-submitit-launcher)."""

from pathlib import Path

from hydra import compose, initialize_config_dir

from experiments.build import build
from experiments.config import register


def test_slurm_launcher_config_composes():


    from experiments.train import __file__ as train_file

    register()
    conf_dir = str(Path(train_file).parent / "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", "runtime=torchrun", "mesh=dp2_fsdp2_tp2"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.nodes * launcher.tasks_per_node == 8 == build(cfg).mesh.size
