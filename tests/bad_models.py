"""Small models and the config the error tests share (test_bad_inputs.py, test_cli_files.py, test_copies.py)."""
from torch import nn

import accelc


CFG = accelc.OptimizeConfig(only_if_faster=False)


class Fc(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x)


class Branch(Fc):
    def forward(self, x):
        y = self.fc(x)
        return y * 2 if y.sum() > 0 else y


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x, scale=None):
        y = self.fc(x)
        return y if scale is None else y * scale
