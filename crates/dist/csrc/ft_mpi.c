/* The MPI backend's C side: thin wrappers over the MPI calls ferrotron-dist uses, so the Rust
 * side needs no bindgen and no knowledge of an implementation's handle types (an MPI_Comm is a
 * pointer in Open MPI and an int in MPICH; here both live behind heap boxes). Every function
 * returns MPI's error code (MPI_SUCCESS = 0); with MPI's default error handler an error
 * aborts the job before it gets here. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static int ft_finalized(void) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    return !init || fin;
}

/* At exit: a process that leaves without ft_finalize is failing (an error returned from main,
 * std::process::exit): MPI_Finalize here would wait for the other ranks, which wait in a
 * collective for this one, so the job would hang. Take it down instead. */
static void ft_at_exit(void) {
    if (ft_finalized()) return;
    int rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    fprintf(stderr,
            "rank %d failed: exited without ferrotron_dist::mpi::finalize (an error or an early "
            "exit); taking the job down\n",
            rank);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* MPI_Init_thread once per process. Returns the thread level given. */
int ft_init(int *provided) {
    int init = 0;
    MPI_Initialized(&init);
    if (init) return MPI_Query_thread(provided);
    int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, provided);
    if (rc == MPI_SUCCESS) atexit(ft_at_exit);
    return rc;
}

/* The normal end of a rank (collective over the world). */
int ft_finalize(void) {
    if (ft_finalized()) return MPI_SUCCESS;
    return MPI_Finalize();
}

int ft_thread_serialized(void) { return MPI_THREAD_SERIALIZED; }
int ft_thread_multiple(void) { return MPI_THREAD_MULTIPLE; }

void *ft_world(void) {
    MPI_Comm *c = malloc(sizeof(MPI_Comm));
    *c = MPI_COMM_WORLD;
    return c;
}

int ft_rank(void *c, int *r) { return MPI_Comm_rank(*(MPI_Comm *)c, r); }
int ft_size(void *c, int *s) { return MPI_Comm_size(*(MPI_Comm *)c, s); }

int ft_tag_ub(int *ub) {
    int *v = NULL, flag = 0;
    int rc = MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &v, &flag);
    *ub = (rc == MPI_SUCCESS && flag) ? *v : 32767;
    return rc;
}

/* The sub-communicator of `parent`'s ranks `members` (in that order), created collectively by
 * those members only (MPI_Comm_create_group). */
int ft_create_group(void *parent, const int *members, int n, int tag, void **out) {
    MPI_Comm p = *(MPI_Comm *)parent;
    MPI_Group pg, g;
    int rc = MPI_Comm_group(p, &pg);
    if (rc != MPI_SUCCESS) return rc;
    rc = MPI_Group_incl(pg, n, members, &g);
    if (rc != MPI_SUCCESS) return rc;
    MPI_Comm *c = malloc(sizeof(MPI_Comm));
    rc = MPI_Comm_create_group(p, g, tag, c);
    MPI_Group_free(&g);
    MPI_Group_free(&pg);
    if (rc != MPI_SUCCESS) {
        free(c);
        return rc;
    }
    *out = c;
    return MPI_SUCCESS;
}

void ft_comm_free(void *c) {
    MPI_Comm *m = (MPI_Comm *)c;
    if (!ft_finalized() && *m != MPI_COMM_WORLD && *m != MPI_COMM_NULL) MPI_Comm_free(m);
    free(m);
}

int ft_allreduce(void *c, float *buf, int n) {
    return MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, *(MPI_Comm *)c);
}

int ft_reduce_scatter(void *c, const float *send, float *recv, int block) {
    return MPI_Reduce_scatter_block(send, recv, block, MPI_FLOAT, MPI_SUM, *(MPI_Comm *)c);
}

int ft_allgather(void *c, const float *send, float *recv, int n) {
    return MPI_Allgather(send, n, MPI_FLOAT, recv, n, MPI_FLOAT, *(MPI_Comm *)c);
}

int ft_bcast(void *c, float *buf, int n, int root) {
    return MPI_Bcast(buf, n, MPI_FLOAT, root, *(MPI_Comm *)c);
}

int ft_alltoall(void *c, const float *send, float *recv, int block) {
    return MPI_Alltoall(send, block, MPI_FLOAT, recv, block, MPI_FLOAT, *(MPI_Comm *)c);
}

int ft_barrier(void *c) { return MPI_Barrier(*(MPI_Comm *)c); }

/* Non-blocking operations: the request lives in a heap box freed by ft_wait / ft_test.
   `started` hands it out when the operation started, and frees it when it did not. */
static int started(int rc, MPI_Request *r, void **req) {
    if (rc != MPI_SUCCESS) {
        free(r);
        return rc;
    }
    *req = r;
    return MPI_SUCCESS;
}

int ft_iallreduce(void *c, float *buf, int n, void **req) {
    MPI_Request *r = malloc(sizeof(MPI_Request));
    return started(MPI_Iallreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, *(MPI_Comm *)c, r),
                   r, req);
}

/* In place: the sum of block `rank` lands in the first block of buf. */
int ft_ireduce_scatter(void *c, float *buf, int block, void **req) {
    MPI_Request *r = malloc(sizeof(MPI_Request));
    return started(MPI_Ireduce_scatter_block(MPI_IN_PLACE, buf, block, MPI_FLOAT, MPI_SUM,
                                             *(MPI_Comm *)c, r),
                   r, req);
}

/* In place: this rank's block is already at block `rank` of buf. */
int ft_iallgather(void *c, float *buf, int block, void **req) {
    MPI_Request *r = malloc(sizeof(MPI_Request));
    return started(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, block, MPI_FLOAT,
                                  *(MPI_Comm *)c, r),
                   r, req);
}

int ft_isend(void *c, const float *buf, int n, int dst, int tag, void **req) {
    MPI_Request *r = malloc(sizeof(MPI_Request));
    return started(MPI_Isend(buf, n, MPI_FLOAT, dst, tag, *(MPI_Comm *)c, r), r, req);
}

int ft_wait(void *req) {
    if (ft_finalized()) { /* nothing can be waited for any more */
        free(req);
        return MPI_SUCCESS;
    }
    int rc = MPI_Wait((MPI_Request *)req, MPI_STATUS_IGNORE);
    free(req);
    return rc;
}

/* *done = 1 (and the request freed) when it has completed. */
int ft_test(void *req, int *done) {
    if (ft_finalized()) {
        free(req);
        *done = 1;
        return MPI_SUCCESS;
    }
    int rc = MPI_Test((MPI_Request *)req, done, MPI_STATUS_IGNORE);
    if (rc == MPI_SUCCESS && *done) free(req);
    return rc;
}

/* A message from `src` with `tag`; *got = its length. It lands in `buf` when that is exactly
 * n elements, and is received and dropped otherwise (the caller reports the mismatch). */
int ft_recv(void *c, float *buf, int n, int src, int tag, int *got) {
    MPI_Comm comm = *(MPI_Comm *)c;
    MPI_Status st;
    int rc = MPI_Probe(src, tag, comm, &st);
    if (rc != MPI_SUCCESS) return rc;
    rc = MPI_Get_count(&st, MPI_FLOAT, got);
    if (rc != MPI_SUCCESS) return rc;
    if (*got == n) return MPI_Recv(buf, n, MPI_FLOAT, src, tag, comm, MPI_STATUS_IGNORE);
    float *tmp = malloc(sizeof(float) * (size_t)(*got > 0 ? *got : 1));
    rc = MPI_Recv(tmp, *got, MPI_FLOAT, src, tag, comm, MPI_STATUS_IGNORE);
    free(tmp);
    return rc;
}

/* Prints `msg` and takes every rank of the job down. */
void ft_abort(const char *msg, int code) {
    fprintf(stderr, "%s\n", msg);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
    _exit(code);
}
