"""The stages before RL, as their peers define them: supervised fine-tuning on completions (sft.py) and a
Bradley-Terry reward model (reward_model.py), on the same actor ranks, update loop and checkpoints as the RL stage."""
