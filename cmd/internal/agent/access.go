package agent

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/hashicorp/go-memdb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/dynamicpb"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/gateway"
	"pilab.hu/pivirt-agent/gateway/access"
	"pilab.hu/pivirt-agent/gateway/authn"
	"pilab.hu/pivirt-agent/gateway/authz"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// RBACPolicyKey is the cluster config key holding a cluster-wide RBAC
// policy (the text of an rbac.yaml): when set, every agent enforces it in
// place of its auth.rbac_policy file.
const RBACPolicyKey = "auth.rbac_policy"

// policyWatchInterval is how often the auth.rbac_policy file is checked
// for changes.
const policyWatchInterval = 5 * time.Second

// apiDescriptors are the services of the API port that carry
// authorization annotations: the agent's own and the routed backend APIs.
func apiDescriptors() []protoreflect.ServiceDescriptor {
	return append([]protoreflect.ServiceDescriptor{
		clusterv1.File_pivirt_cluster_v1_cluster_proto.Services().ByName("ClusterService"),
		clusterv1.File_pivirt_cluster_v1_snapshot_proto.Services().ByName("SnapshotService"),
	}, apiServices...)
}

// policyResources are the resources a policy may name.
func policyResources() []string { return authz.Resources(apiDescriptors()...) }

// startAccess builds the API port's access control. It is off (every call
// allowed, with a warning) only when nothing could authenticate a caller:
// tls.enabled false and neither auth.oidc nor auth.rbac_policy set.
func (a *Agent) startAccess() error {
	ac := a.cfg.Auth
	if !a.cfg.TLS.Enabled && ac.OIDC.IssuerURL == "" && ac.RBACPolicy == "" {
		a.logger.Warn("ACCESS CONTROL IS OFF: the API port accepts every call without credentials (tls.enabled is false and neither auth.oidc nor auth.rbac_policy is set)")
		return nil
	}
	auth := &authn.Authenticator{CertRoles: ac.CertificateRoles}
	if ac.OIDC.IssuerURL != "" {
		a.wg.Add(1)
		auth.OIDC = authn.Discover(a.ctx, authn.OIDCConfig{
			IssuerURL:     ac.OIDC.IssuerURL,
			ClientID:      ac.OIDC.ClientID,
			IdentityClaim: ac.OIDC.IdentityClaim,
			RolesClaim:    ac.OIDC.RolesClaim,
			Logger:        a.logger,
		}, a.wg.Done)
	}
	if ac.RBACPolicy != "" {
		f, err := authz.LoadFile(ac.RBACPolicy, policyResources(), a.logger)
		if err != nil {
			return err
		}
		a.policyFile = f
		a.wg.Go(func() { f.Watch(a.ctx, policyWatchInterval) })
	} else {
		a.logger.Warn("no auth.rbac_policy: every authenticated caller may call every method; set a policy to restrict them")
	}
	a.wg.Go(func() { a.watchClusterPolicy(a.ctx) })
	limits := access.Limits{}
	if rl := a.cfg.RateLimiting; rl.Enabled {
		limits.Default = access.Limit{PerSecond: rl.RequestsPerSecond, Burst: rl.Burst}
		for _, r := range rl.Routes {
			limits.Routes = append(limits.Routes, access.RouteLimit{Prefix: r.Prefix, Limit: access.Limit{PerSecond: r.RequestsPerSecond, Burst: r.Burst}})
		}
	}
	g, err := access.New(access.Config{
		Authenticator: auth,
		Policy:        a.policy,
		Limits:        limits,
		Fetch:         a.fetchObject,
		ConnState:     gateway.ConnTLSFromContext,
		Logger:        a.logger.With("component", "access"),
		Registerer:    a.metrics,
	})
	if err != nil {
		return err
	}
	a.guard = g
	return nil
}

// policy is the RBAC policy in force: the cluster-wide one when set, else
// the auth.rbac_policy file's, else none.
func (a *Agent) policy() *authz.Policy {
	if p := a.clusterPolicy.Load(); p != nil {
		return p
	}
	if a.policyFile != nil {
		return a.policyFile.Policy()
	}
	return nil
}

// accessServerOptions are the API port's gRPC interceptors.
func (a *Agent) accessServerOptions() []grpc.ServerOption {
	if a.guard == nil {
		return nil
	}
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(a.guard.UnaryServerInterceptor()),
		grpc.ChainStreamInterceptor(a.guard.StreamServerInterceptor()),
	}
}

// fetchObject reads the object a conditional RBAC rule is checked against,
// with the service's get method, from the backend that serves it.
func (a *Agent) fetchObject(ctx context.Context, get protoreflect.MethodDescriptor, req protoreflect.ProtoMessage) (protoreflect.ProtoMessage, error) {
	method := "/" + string(get.Parent().FullName()) + "/" + string(get.Name())
	b := a.proxy.Route(method)
	if b == nil {
		return nil, status.Errorf(codes.Unimplemented, "no routing rule matches %s", method)
	}
	var resp protoreflect.ProtoMessage
	if mt, err := protoregistry.GlobalTypes.FindMessageByName(get.Output().FullName()); err == nil {
		resp = mt.New().Interface()
	} else {
		resp = dynamicpb.NewMessage(get.Output())
	}
	if err := b.Invoke(ctx, method, req, resp); err != nil {
		return nil, err
	}
	return resp, nil
}

// validateClusterConfig checks cluster config documents the agent reads
// before they are stored: a cluster-wide RBAC policy must parse, validate,
// and leave some role able to change the config again.
func (a *Agent) validateClusterConfig(key, value string) error {
	if key != RBACPolicyKey {
		return nil
	}
	p, err := authz.Parse(strings.NewReader(value), policyResources())
	if err != nil {
		return err
	}
	if !p.Grants("config", "update") {
		return fmt.Errorf("%w: no rule lets any role update the config without conditions: the policy could never be changed or removed again", authz.ErrInvalidPolicy)
	}
	return nil
}

// watchClusterPolicy keeps the cluster-wide RBAC policy (config key
// auth.rbac_policy) in force as it changes. A version that does not parse
// here (written by a newer agent) is logged and the policy in use stays.
func (a *Agent) watchClusterPolicy(ctx context.Context) {
	var applied uint64
	for ctx.Err() == nil {
		ws := memdb.NewWatchSet()
		st := a.fsm.State()
		if _, err := st.WatchConfigKey(ws, RBACPolicyKey); err != nil {
			a.logger.Error("watching the cluster RBAC policy failed; retrying", "error", err)
			if !sleepCtx(ctx, time.Second) {
				return
			}
			continue
		}
		e, err := st.ConfigEntry(RBACPolicyKey)
		switch {
		case errors.Is(err, fsm.ErrNotFound):
			if a.clusterPolicy.Swap(nil) != nil {
				a.logger.Info("cluster-wide RBAC policy removed; the auth.rbac_policy file applies", "file", a.cfg.Auth.RBACPolicy)
			}
			applied = 0
		case err != nil:
			a.logger.Error("reading the cluster RBAC policy failed", "error", err)
		case e.GetRevision() != applied:
			applied = e.GetRevision()
			p, err := authz.Parse(strings.NewReader(e.GetValue()), policyResources())
			if err != nil {
				a.logger.Error("cluster-wide RBAC policy not applied; keeping the policy in use", "revision", e.GetRevision(), "error", err)
				break
			}
			a.clusterPolicy.Store(p)
			a.logger.Info("cluster-wide RBAC policy in force", "revision", e.GetRevision(), "rules", len(p.Rules))
		}
		if err := ws.WatchCtx(ctx); err != nil {
			return
		}
	}
}

// Reload reads the files the agent can take up without a restart again
// (SIGHUP, POST /reload): certificates and the RBAC policy file. What
// fails to load stays as it was; the error names it.
func (a *Agent) Reload() (reloaded []string, err error) {
	reloaded = []string{}
	var errs []error
	if a.tls != nil {
		if err := a.ReloadTLS(); err != nil {
			errs = append(errs, err)
		} else {
			reloaded = append(reloaded, "tls")
		}
	}
	if a.policyFile != nil {
		if err := a.policyFile.Reload(); err != nil {
			errs = append(errs, err)
		} else {
			reloaded = append(reloaded, "auth.rbac_policy")
		}
	}
	if a.netPolicy != nil {
		if err := a.netPolicy.Reload(); err != nil {
			errs = append(errs, err)
		} else {
			reloaded = append(reloaded, "auth.network_policy")
		}
	}
	return reloaded, errors.Join(errs...)
}

// reloadHandler is POST /reload.
func (a *Agent) reloadHandler(w http.ResponseWriter, r *http.Request) {
	if !loopbackCaller(r) {
		writeJSON(w, http.StatusForbidden, map[string]any{"status": "error", "error": "reload answers loopback callers only"})
		return
	}
	reloaded, err := a.Reload()
	if err != nil {
		writeJSON(w, http.StatusUnprocessableEntity, map[string]any{"status": "error", "error": err.Error(), "reloaded": reloaded,
			"kept": "what failed to load stays in use as it was; the rest was reloaded"})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "reloaded": reloaded})
}
