"""ZeRO by hand (lesson 13): the optimizer state (stage 1), the gradients (stage 2) and the
parameters (stage 3) cut into one slice per rank, with two collectives and nothing else.

Use it in a script that torchrun started, after init_process_group:
    units = [FlatShard(m, stage) for m in (model.stem, *model.blocks, model.head)]
    optimizer = torch.optim.AdamW([unit.shard for unit in units], lr=...)
    loss.backward()
    zero_step(units, optimizer, stage)
"""
import torch
import torch.distributed as dist


class FlatShard:
    """One unit's parameters in one flat buffer, padded to a multiple of the world size W.
    The buffer splits into W equal slices; rank r owns slice r, and only r updates it."""

    def __init__(self, module: torch.nn.Module, stage: int):
        self.params, self.stage, self.ready = list(module.parameters()), stage, 0
        world_size, rank = dist.get_world_size(), dist.get_rank()
        numel = sum(p.numel() for p in self.params)
        self.padding = -numel % world_size  # zeros at the end, so that W slices are equal
        self.flat = torch.zeros(numel + self.padding, device=self.params[0].device)
        offset = 0
        for p in self.params:  # each parameter becomes a view into the flat buffer
            self.flat[offset:offset + p.numel()] = p.detach().flatten()
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        size = self.flat.numel() // world_size
        self.shard = self.flat[rank * size:(rank + 1) * size]  # this rank's slice (a view)
        if stage >= 2:  # reduce the unit's gradients as soon as backward has made them
            for p in self.params:
                p.register_post_accumulate_grad_hook(self.grad_ready)
        if stage == 3:  # keep the slice alone; the unit is whole only while it computes
            self.shard = self.shard.clone()
            self.free()
            module.register_forward_pre_hook(lambda m, inputs: self.gather())
            module.register_forward_hook(lambda m, inputs, output: self.free())
            module.register_full_backward_pre_hook(lambda m, grad_output: self.gather())

    def gather(self) -> None:
        """ZeRO-3: every rank's slice, all-gathered into the whole flat buffer."""
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())
        dist.all_gather_single(self.flat, self.shard)

    def free(self) -> None:
        """ZeRO-3: the parameters stay views into the buffer; the memory behind them goes."""
        self.flat.untyped_storage().resize_(0)

    def reduce_scatter(self) -> None:
        """Average the unit's gradients over the ranks; this rank keeps its own slice only."""
        grads = [p.grad.flatten() for p in self.params]
        flat_grad = torch.cat(grads + [grads[0].new_zeros(self.padding)])
        self.shard.grad = torch.empty_like(self.shard)
        dist.reduce_scatter_single(self.shard.grad, flat_grad)  # each slice summed over ranks...
        self.shard.grad /= dist.get_world_size()  # ...and divided by W: the mean, as in DDP

    def grad_ready(self, param) -> None:
        """ZeRO-2 and 3: called as each of the unit's gradients is accumulated."""
        self.ready += 1
        if self.ready < len(self.params):
            return
        self.ready = 0  # the unit's last gradient: reduce them all now, during backward
        self.reduce_scatter()
        for p in self.params:
            p.grad = None  # the whole gradients go at once: only the slice stays
        if self.stage == 3:
            self.free()  # gathered again for its backward: free it again


def zero_step(units: list, optimizer: torch.optim.Optimizer, stage: int) -> None:
    """The optimizer step: each rank updates its own slices, then (stages 1, 2) shares them."""
    if stage == 1:  # ZeRO-1 kept every gradient whole until now
        for unit in units:
            unit.reduce_scatter()
    optimizer.step()  # AdamW on this rank's slices only: its state is 1/W of DDP's
    if stage < 3:  # ZeRO-3 gathers each unit just before it next computes
        for unit in units:
            dist.all_gather_single(unit.flat, unit.shard)  # in place: slice r from rank r
