"""The seed document's Hogwild example, run as it stands with ``import sharedmp as mp``.

The part between the two rulers is the seed's code, unchanged except for the import.
The seed leaves its data, optimizer and sizes undefined; they are defined above it:
scikit-learn's bundled 8x8 digits (no download) and plain SGD over the shared model.
Like the seed, it relies on the fork start method (``mp.Process`` is the standard one):
the children inherit ``optimizer`` and ``data_loader``, and ``model.share_memory()`` makes
the parameters they step shared. Fork is the Linux default before Python 3.14 only
(forkserver from 3.14), so it is set here, above the seed's code.

    python examples/hogwild.py        # needs torch and scikit-learn (the "demo" extra)
"""
import multiprocessing

import torch
import torch.nn as nn
from sklearn.datasets import load_digits

multiprocessing.set_start_method("fork")   # the seed's (the default before Python 3.14)
torch.set_num_threads(1)          # 4 processes on a few cores: one thread each
torch.manual_seed(0)
X, y = load_digits(return_X_y=True)
X = torch.tensor(X / 16.0, dtype=torch.float32)
y = torch.tensor(y)
X_train, y_train, X_test, y_test = X[:1400], y[:1400], X[1400:], y[1400:]
data_loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(X_train, y_train), batch_size=32, shuffle=True)
n_in, n_h1, n_out = 64, 128, 10
loss_fn = nn.CrossEntropyLoss()


def accuracy(model):
    with torch.no_grad():
        return (model(X_test).argmax(dim=1) == y_test).float().mean().item()


# ----------------------------------------------------------------------- the seed's code
import sharedmp as mp  # was: import torch.multiprocessing as mp  # noqa: E402


def train(model):
    for data, labels in data_loader:
        optimizer.zero_grad()
        loss_fn(model(data), labels).backward()
        optimizer.step()  # 更新共享参数


# 定义模型
model = nn.Sequential(
    nn.Linear(n_in, n_h1),
    nn.ReLU(),
    nn.Linear(n_h1, n_out)
)
# (not the seed's: the optimizer it uses, and the accuracy before training)
optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
before = accuracy(model)

# 将模型移至共享内存（fork方法必须）
model.share_memory()

# 创建多个进程
processes = []
for i in range(4):  # 4个进程
    p = mp.Process(target=train, args=(model,))
    p.start()
    processes.append(p)

for p in processes:
    p.join()
# ------------------------------------------------------------------------------------------

# The parent never stepped: its model learned because the children wrote its memory.
after = accuracy(model)
print(f"test accuracy of the parent's model: {before:.1%} before, {after:.1%} after "
      f"4 processes trained it (exit codes {[p.exitcode for p in processes]})")
if not (all(p.exitcode == 0 for p in processes) and after > 0.8):
    raise SystemExit("the shared model did not learn")
