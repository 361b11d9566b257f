/* net7_train.h - what test_chaos.c and test_mpi_errors.c train net7.h's
   model with: an MSE step body, a seeded batch per (step, replica), a
   digest of this rank's parameters to compare runs bit for bit, SGD, and
   a count of the messages a step left queued. Include after smp_pipeline.h
   and net7.h, with SMP_IMPLEMENTATION (it reads smp's internals). */
#ifndef NET7_TRAIN_H
#define NET7_TRAIN_H

SMP_STEP_BODY(mse_body) {
    const smp_tensor *y = smp_mb_output(mb, 0), *t = smp_mb_arg(mb, 1);
    smp_tensor *g = smp_mb_output_grad(mb, 0);
    return smp_mb_return_f32(
        mb, 0,
        mse((const float *)y->data, (const float *)t->data, g ? (float *)g->data : NULL, (int)smp_tensor_numel(y)));
}

/* The batch of step s for replica r: the same in both runs. */
static void batch(int s, int r, float *x, float *t) {
    uint64_t state = (uint64_t)s * 1000003u + (uint64_t)r * 7919u + 1;
    for (int i = 0; i < B * D; i++) x[i] = (float)(smp__splitmix(&state) % 2001) / 1000.0f - 1.0f;
    for (int i = 0; i < B * C; i++) t[i] = (float)(smp__splitmix(&state) % 2001) / 1000.0f - 1.0f;
}

/* FNV-1a over this rank's local parameter bytes, in model order. */
static uint64_t digest(smp_model *model) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; smp_model_local_param(model, i, false); i++) {
        const smp_tensor *v = smp_param_value(smp_model_local_param(model, i, false));
        for (size_t k = 0; k < smp_tensor_nbytes(v); k++)
            h = (h ^ ((const unsigned char *)v->data)[k]) * 1099511628211ull;
    }
    return h;
}

static void sgd(smp_model *model) {
    for (int i = 0; smp_model_local_param(model, i, false); i++) {
        smp_param *p = smp_model_local_param(model, i, false);
        if (smp_param_is_buffer(p)) continue;
        float *w = (float *)smp_param_value(p)->data;
        const float *g = (const float *)smp_param_grad(p)->data;
        for (int64_t k = 0; k < smp_tensor_numel(smp_param_value(p)); k++) w[k] -= 0.05f * g[k];
    }
}

/* Messages waiting on the pipeline's communicators (smp's internals: the
   test defines SMP_IMPLEMENTATION). Asked before the ranks next meet, so
   no peer can have started the next step's sends. */
static inline int pending_messages(smp_model *model) {
    smp__pipe *ps = (smp__pipe *)model->pipeline;
    int n = 0;
    for (int c = 0; ps && c < 2; c++)
        for (;;) {
            int flag = 0;
            MPI_Status st;
            MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, c ? ps->err_comm : ps->comm, &flag, &st);
            if (!flag) break;
            n++;
            /* receive it, so the count is of messages, not of probes of the first one */
            int bytes = 0;
            MPI_Get_count(&st, MPI_BYTE, &bytes);
            char *buf = (char *)malloc(bytes > 0 ? (size_t)bytes : 1);
            MPI_Recv(buf, bytes, MPI_BYTE, st.MPI_SOURCE, st.MPI_TAG, c ? ps->err_comm : ps->comm, MPI_STATUS_IGNORE);
            free(buf);
        }
    return n;
}

#endif
