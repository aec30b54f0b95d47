"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial loop, with NumPy
for the model and ``import mpistrat as tfd`` where the tutorial has ``tf.distribute``.

    mpistrat run -n 2 examples/tf_custom_loop.py
    mpistrat run -n 3 --local-replicas 2 examples/tf_custom_loop.py --epochs 10

The structure is the tutorial's, step for step: a strategy; a dataset of global batches
distributed with ``strategy.experimental_distribute_dataset``; the model, optimizer and
checkpoint made in ``strategy.scope()``; a ``train_step`` that computes the per-example
loss, scales it by the global batch size (``compute_average_loss``) and applies the
gradients; ``strategy.run`` of that step and ``strategy.reduce`` of the per-replica losses;
each epoch iterated with ``get_next_as_optional`` (every worker sees the end of the epoch at
the same step, also when the last global batch does not fill every replica); a checkpoint
saved every epoch and, at the end, restored into a new model that is then evaluated.

What TensorFlow does for the tutorial and is written out here: the model's forward and
backward pass (NumPy instead of Keras and ``GradientTape``) and ``apply_gradients`` (Keras'
optimizer sums the replicas' gradients in the replica context; here one
``ReplicaContext.all_reduce`` and a ``merge_call``). The global batch is fixed (not
per-replica batch x replicas, as in the tutorial), so any number of ranks trains the same
model as one process, up to float rounding. Rank 0 prints one line per epoch.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import mpistrat as tfd


def load_digits_split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (no download) scaled to [0, 1], 80/20 split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        sys.exit("this example reads scikit-learn's bundled digits: pip install "
                 "'mpistrat[examples]'")
    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(images))
    cut = int(0.8 * len(images))
    train, test = order[:cut], order[cut:]
    return images[train], labels[train], images[test], labels[test]


class Dense:
    """``y = activation(x @ kernel + bias)``, its variables mirrored on every replica."""

    def __init__(self, units_in: int, units_out: int, relu: bool, rng: np.random.Generator,
                 name: str) -> None:
        scale = np.sqrt((2.0 if relu else 1.0) / units_in)
        self.kernel = tfd.Variable(rng.normal(0, scale, (units_in, units_out)).astype(np.float32),
                                   name=f"{name}/kernel")
        self.bias = tfd.Variable(np.zeros(units_out, np.float32), name=f"{name}/bias")
        self.relu = relu

    @property
    def trainable_variables(self) -> list:
        return [self.kernel, self.bias]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ np.asarray(self.kernel) + np.asarray(self.bias)
        return np.maximum(y, 0) if self.relu else y

    def backward(self, x: np.ndarray, y: np.ndarray, dy: np.ndarray
                 ) -> tuple[np.ndarray, list[np.ndarray]]:
        """The gradient at the input and of (kernel, bias), given the output's ``dy``."""
        if self.relu:
            dy = dy * (y > 0)
        return dy @ np.asarray(self.kernel).T, [x.T @ dy, dy.sum(axis=0)]


class Model:
    """Two dense layers, 64 -> hidden -> 10 logits (the tutorial's ``create_model``)."""

    def __init__(self, hidden: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.layers = [Dense(64, hidden, True, rng, "dense"), Dense(hidden, 10, False, rng,
                                                                   "logits")]

    @property
    def trainable_variables(self) -> list:
        return [v for layer in self.layers for v in layer.trainable_variables]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        for layer in self.layers:
            x = layer(x)
        return x

    def loss_and_gradients(self, images: np.ndarray, labels: np.ndarray, global_batch: int
                           ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """The tutorial's ``compute_loss`` and ``tape.gradient``: the per-example
        cross-entropy summed and divided by the *global* batch size
        (``tf.nn.compute_average_loss``), so that summing the replicas' losses and gradients
        gives the global batch's mean; and the replica's correct predictions."""
        activations = [images]
        for layer in self.layers:
            activations.append(layer(activations[-1]))
        logits = activations[-1]
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        rows = np.arange(len(labels))
        loss = -log_probs[rows, labels].sum() / global_batch
        correct = np.float32((logits.argmax(axis=1) == labels).sum())
        d = np.exp(log_probs)
        d[rows, labels] -= 1
        d /= global_batch
        grads: list[np.ndarray] = []
        for i in reversed(range(len(self.layers))):
            d, layer_grads = self.layers[i].backward(activations[i], activations[i + 1], d)
            grads = layer_grads + grads
        return np.float32(loss), correct, [g.astype(np.float32) for g in grads]


class SGD:
    """Momentum SGD whose ``apply_gradients`` works in a replica context as Keras' does:
    the replicas' gradients are summed across every replica of every worker, then each
    variable (and its slot) is updated once, the same way on every rank."""

    def __init__(self, learning_rate: float, momentum: float, variables: list) -> None:
        self.learning_rate = learning_rate
        self.momentum = momentum
        self.velocities = [tfd.Variable(np.zeros(v.shape, np.float32), trainable=False,
                                        name=f"momentum/{v.name}") for v in variables]

    def apply_gradients(self, grads_and_vars) -> None:
        grads, variables = zip(*grads_and_vars)
        context = tfd.get_replica_context()
        summed = context.all_reduce(tfd.ReduceOp.SUM, list(grads))  # one batched all-reduce
        context.merge_call(self._apply, args=(summed, variables))

    def _apply(self, strategy: tfd.Strategy, grads, variables) -> None:
        for velocity, grad, variable in zip(self.velocities, grads, variables):
            grad = strategy.experimental_local_results(grad)[0]
            velocity.assign(self.momentum * velocity.read_value() - self.learning_rate * grad)
            variable.assign_add(velocity.read_value())


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default="./training_checkpoints",
                        help="one checkpoint per epoch (the chief writes it)")
    args = parser.parse_args(argv)

    strategy = tfd.MultiWorkerMirroredStrategy()
    chief = strategy.extended.should_checkpoint
    if chief:
        print(f"Number of devices: {strategy.num_replicas_in_sync}", flush=True)
    train_images, train_labels, test_images, test_labels = load_digits_split(args.seed)
    GLOBAL_BATCH_SIZE = args.global_batch_size

    train_dataset = (tfd.Dataset.from_tensor_slices((train_images, train_labels))
                     .shuffle(len(train_images), seed=args.seed).batch(GLOBAL_BATCH_SIZE))
    test_dataset = tfd.Dataset.from_tensor_slices((test_images, test_labels)) \
        .batch(GLOBAL_BATCH_SIZE)
    # every worker reads the whole (in-memory) data and keeps its share of each batch
    options = tfd.Options()  # tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tfd.AutoShardPolicy.DATA
    train_dist_dataset = strategy.experimental_distribute_dataset(
        train_dataset.with_options(options))
    test_dist_dataset = strategy.experimental_distribute_dataset(
        test_dataset.with_options(options))

    checkpoint_prefix = os.path.join(args.checkpoint_dir, "ckpt")
    with strategy.scope():
        model = Model(args.hidden, args.seed)
        optimizer = SGD(args.learning_rate, 0.9, model.trainable_variables)
        checkpoint = tfd.Checkpoint(optimizer=optimizer.velocities,
                                    model=model.trainable_variables)

    def train_step(inputs):
        images, labels = inputs
        loss, correct, gradients = model.loss_and_gradients(images, labels, GLOBAL_BATCH_SIZE)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss, correct

    def test_step(inputs):
        images, labels = inputs
        return np.float32((model(images).argmax(axis=1) == labels).sum())

    def distributed_train_step(dataset_inputs):
        per_replica_losses, per_replica_correct = strategy.run(train_step, args=(dataset_inputs,))
        return (strategy.reduce(tfd.ReduceOp.SUM, per_replica_losses, axis=None),
                strategy.reduce(tfd.ReduceOp.SUM, per_replica_correct, axis=None))

    def distributed_test_step(dataset_inputs):
        return strategy.reduce(tfd.ReduceOp.SUM, strategy.run(test_step, args=(dataset_inputs,)),
                               axis=None)

    def test_accuracy() -> float:
        correct = sum(float(distributed_test_step(x)) for x in test_dist_dataset)
        return correct / len(test_images)

    accuracy = 0.0
    for epoch in range(args.epochs):
        total_loss = 0.0
        num_batches = 0
        train_correct = 0.0
        iterator = iter(train_dist_dataset)
        while True:  # every worker leaves the loop at the same step
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                break
            loss, correct = distributed_train_step(optional.get_value())
            total_loss += float(loss)
            train_correct += float(correct)
            num_batches += 1
        train_loss = total_loss / num_batches
        accuracy = test_accuracy()
        checkpoint.save(checkpoint_prefix)
        if chief:
            print(f"Epoch {epoch + 1}, Loss: {train_loss:.4f}, "
                  f"Accuracy: {100 * train_correct / len(train_images):.2f}, "
                  f"Test Accuracy: {100 * accuracy:.2f}", flush=True)

    # the tutorial's last part: restore the latest checkpoint into a new model and test it
    with strategy.scope():
        model = Model(args.hidden, args.seed + 1)
        restored = tfd.Checkpoint(optimizer=optimizer.velocities,
                                  model=model.trainable_variables)
    restored.restore(tfd.latest_checkpoint(args.checkpoint_dir))
    restored_accuracy = test_accuracy()
    if chief:
        print(f"final test accuracy {accuracy:.4f}", flush=True)
        print(f"restored test accuracy {restored_accuracy:.4f}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
