package operator

import (
	"context"
	"crypto"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"pilab.hu/pivirt-agent/cmd/internal/operator/certz/v1alpha1"
	"pilab.hu/pivirt-agent/identity"
)

// Names the operator writes on Secrets and resources.
const (
	// caKey is the Secret's key of the CA chain (the intermediate and the
	// root), as cert-manager names it.
	caKey = "ca.crt"

	// labelCertificate marks a Secret as a ManagedCertificate's (its
	// name); the operator's Secret cache holds only such Secrets.
	labelCertificate = "certz.pilab.hu/certificate-name"

	annotationSpecHash = "certz.pilab.hu/spec-hash"
	annotationRevision = "certz.pilab.hu/revision"
	annotationSerial   = "certz.pilab.hu/serial"
	annotationIssuer   = "certz.pilab.hu/issuer"
	// annotationRenew on a resource asks for a new certificate (and key)
	// now: any value not yet handled, as the Secret's copy of it says
	// (kubectl annotate … certz.pilab.hu/renew=$(date +%s) --overwrite).
	annotationRenew = "certz.pilab.hu/renew"

	// finalizer holds a deleted resource until its certificate is revoked.
	finalizer = "certz.pilab.hu/revoke"

	// recheck is the longest a valid certificate goes without a look.
	recheck = time.Hour
)

// eventRecorder is what the reconciler needs of an events recorder
// (events.k8s.io/v1).
type eventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...any)
}

// Reconciler keeps each ManagedCertificate's Secret holding a valid
// certificate of its spec.
type Reconciler struct {
	// Client writes; Reader reads uncached (the resource and its Secret
	// are read fresh at each reconcile, so that a stale cache can never
	// make a second issuance).
	Client   client.Client
	Reader   client.Reader
	Issuers  *issuers
	Events   eventRecorder
	Metrics  *metrics
	Logger   *slog.Logger
	RetryMin time.Duration
	RetryMax time.Duration
	Now      func() time.Time
}

// Reconcile brings one ManagedCertificate's Secret in line.
func (r *Reconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	mc := &v1alpha1.ManagedCertificate{}
	if err := r.Reader.Get(ctx, req.NamespacedName, mc); err != nil {
		if apierrors.IsNotFound(err) {
			r.Metrics.forget(req.Namespace, req.Name)
			return reconcile.Result{}, nil
		}
		return reconcile.Result{}, err
	}
	if !mc.DeletionTimestamp.IsZero() {
		return r.finalize(ctx, mc)
	}
	orig := mc.Status.DeepCopy()
	if !controllerutil.ContainsFinalizer(mc, finalizer) {
		controllerutil.AddFinalizer(mc, finalizer)
		if err := r.Client.Update(ctx, mc); err != nil {
			return reconcile.Result{}, err
		}
	}
	now := r.Now()
	w, err := wantedOf(mc)
	if err != nil {
		return r.fail(ctx, mc, nil, &issuerError{ReasonInvalidSpec, err})
	}
	iss, err := r.Issuers.forRef(ctx, mc.Namespace, mc.Spec.IssuerRef.URL, mc.Spec.IssuerRef.CABundle, mc.Spec.IssuerRef.SecretName)
	if err != nil {
		return r.fail(ctx, mc, nil, err)
	}
	secret, err := r.secret(ctx, mc)
	if err != nil {
		return r.fail(ctx, mc, nil, err)
	}
	specHash := w.hash(mc.Spec.IssuerRef)
	cur, reason, message := inspect(secret, w, specHash, now)
	if want := mc.Annotations[annotationRenew]; reason == "" && want != "" && want != secret.Annotations[annotationRenew] {
		reason, message = "RenewalRequested", fmt.Sprintf("a renewal was requested (annotation %s=%s)", annotationRenew, want)
	}
	if reason == "" {
		if err := r.keepSecretMeta(ctx, mc, secret); err != nil {
			return reconcile.Result{}, err
		}
		r.retryRevocations(ctx, mc, iss)
		return r.ready(ctx, mc, orig, w, secret, cur, now)
	}
	log := r.Logger.With("namespace", mc.Namespace, "name", mc.Name)
	log.Info("issuing", "reason", reason, "detail", message)
	if !meta.IsStatusConditionTrue(mc.Status.Conditions, v1alpha1.ConditionIssuing) {
		// Say so before the CA is asked: the write also fails if another
		// writer changed the resource meanwhile.
		meta.SetStatusCondition(&mc.Status.Conditions, metav1.Condition{
			Type: v1alpha1.ConditionIssuing, Status: metav1.ConditionTrue, Reason: reason, Message: message, ObservedGeneration: mc.Generation,
		})
		if err := r.Client.Status().Update(ctx, mc); err != nil {
			return reconcile.Result{}, err
		}
	}
	var key crypto.Signer
	if w.rotation == v1alpha1.RotationNever && cur.key != nil && w.fitsKey(cur.key.Public()) && reason != "RenewalRequested" {
		key = cur.key
	} else if key, err = w.newKey(); err != nil {
		return reconcile.Result{}, err
	}
	ctxIssue, cancel := context.WithTimeout(ctx, 30*time.Second)
	out, err := iss.issue(ctxIssue, request{
		Name: w.name, Kind: w.kind, Usages: w.usages, DNS: w.dns, IPs: w.ips, Cluster: w.cluster, Lifetime: w.duration, Key: key,
	})
	cancel()
	if err != nil {
		r.Metrics.issuanceError(mc.Namespace, mc.Name, reasonOf(err))
		return r.fail(ctx, mc, secret, err)
	}
	revision := mc.Status.Revision
	if secret != nil {
		if n, err := strconv.ParseInt(secret.Annotations[annotationRevision], 10, 64); err == nil {
			revision = max(revision, n)
		}
	}
	revision++
	keyPEM, err := identity.KeyPEM(key)
	if err != nil {
		return reconcile.Result{}, err
	}
	desired := r.desiredSecret(mc, secret)
	desired.Data = map[string][]byte{corev1.TLSCertKey: out.ChainPEM, corev1.TLSPrivateKeyKey: keyPEM, caKey: out.CAPEM}
	desired.Annotations[annotationSpecHash] = specHash
	desired.Annotations[annotationRevision] = strconv.FormatInt(revision, 10)
	desired.Annotations[annotationSerial] = identity.SerialHex(out.Leaf.SerialNumber)
	desired.Annotations[annotationIssuer] = iss.String()
	if want := mc.Annotations[annotationRenew]; want != "" {
		desired.Annotations[annotationRenew] = want
	}
	if err := r.writeSecret(ctx, secret, desired); err != nil {
		// The certificate is not handed out: revoke it, so that nothing
		// unaccounted for stays valid.
		r.revoke(ctx, mc, iss, identity.SerialHex(out.Leaf.SerialNumber), "superseded", "the Secret could not be written")
		return reconcile.Result{}, fmt.Errorf("write Secret %s/%s: %w", mc.Namespace, mc.Spec.SecretName, err)
	}
	serial := identity.SerialHex(out.Leaf.SerialNumber)
	r.Metrics.issued(mc.Namespace, mc.Name)
	r.Events.Eventf(mc, nil, corev1.EventTypeNormal, "Issued", "Issue",
		"Issued certificate serial %s by %s, valid until %s, in Secret %s (revision %d; %s)", serial, iss, out.Leaf.NotAfter.UTC().Format(time.RFC3339), mc.Spec.SecretName, revision, message)
	log.Info("issued", "serial", serial, "not_after", out.Leaf.NotAfter.UTC().Format(time.RFC3339), "revision", revision, "secret", mc.Spec.SecretName)
	// The certificate replaced — the one this resource last issued, never
	// whatever a tampered Secret holds — is revoked when the policy says.
	if prev := issuedSerial(mc, secret); prev != "" && prev != serial {
		scheduled := reason == "Renewing"
		if w.revocation == v1alpha1.RevokeOnRenewal || (w.revocation == v1alpha1.RevokeOnDelete && !scheduled) {
			if !r.revoke(ctx, mc, iss, prev, "superseded", message) {
				mc.Status.PendingRevocations = appendSet(mc.Status.PendingRevocations, prev)
			}
		}
	}
	mc.Status.Revision = revision
	mc.Status.FailedIssuanceAttempts = 0
	mc.Status.LastFailureTime = nil
	secret = desired
	return r.ready(ctx, mc, orig, w, secret, current{leaf: out.Leaf, key: key, serial: serial}, now)
}

// ready records a valid certificate in the status and metrics, and asks
// to be called again at its renewal time.
func (r *Reconciler) ready(ctx context.Context, mc *v1alpha1.ManagedCertificate, before *v1alpha1.ManagedCertificateStatus, w wanted, secret *corev1.Secret, cur current, now time.Time) (reconcile.Result, error) {
	renewal := w.renewalTime(cur.leaf)
	st := &mc.Status
	st.NotBefore = &metav1.Time{Time: cur.leaf.NotBefore}
	st.NotAfter = &metav1.Time{Time: cur.leaf.NotAfter}
	st.RenewalTime = &metav1.Time{Time: renewal}
	st.SerialNumber = cur.serial
	if n, err := strconv.ParseInt(secret.Annotations[annotationRevision], 10, 64); err == nil {
		st.Revision = n
	}
	st.ObservedGeneration = mc.Generation
	st.FailedIssuanceAttempts = 0
	st.LastFailureTime = nil
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{
		Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: "Ready", ObservedGeneration: mc.Generation,
		Message: fmt.Sprintf("Secret %s holds certificate serial %s, valid until %s", mc.Spec.SecretName, cur.serial, cur.leaf.NotAfter.UTC().Format(time.RFC3339)),
	})
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{
		Type: v1alpha1.ConditionIssuing, Status: metav1.ConditionFalse, Reason: "UpToDate", ObservedGeneration: mc.Generation,
		Message: "renewal at " + renewal.UTC().Format(time.RFC3339),
	})
	if !statusEqual(before, st) {
		if err := r.Client.Status().Update(ctx, mc); err != nil {
			return reconcile.Result{}, err
		}
	}
	r.Metrics.ready(mc.Namespace, mc.Name, true, cur.leaf.NotAfter, renewal)
	return reconcile.Result{RequeueAfter: min(max(renewal.Sub(now), time.Second), recheck)}, nil
}

// fail records a failed attempt (Ready=False unless the Secret still holds
// a valid certificate of the spec) and retries with backoff.
func (r *Reconciler) fail(ctx context.Context, mc *v1alpha1.ManagedCertificate, secret *corev1.Secret, cause error) (reconcile.Result, error) {
	reason := reasonOf(cause)
	now := r.Now()
	st := &mc.Status
	st.FailedIssuanceAttempts++
	st.LastFailureTime = &metav1.Time{Time: now}
	st.ObservedGeneration = mc.Generation
	stillValid := false
	if secret != nil && st.NotAfter != nil && now.Before(st.NotAfter.Time) {
		if w, err := wantedOf(mc); err == nil {
			if _, why, _ := inspect(secret, w, w.hash(mc.Spec.IssuerRef), now); why == "Renewing" {
				stillValid = true
			}
		}
	}
	if !stillValid {
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{
			Type: v1alpha1.ConditionReady, Status: metav1.ConditionFalse, Reason: reason, Message: cause.Error(), ObservedGeneration: mc.Generation,
		})
		r.Metrics.ready(mc.Namespace, mc.Name, false, notAfterOf(st), renewalOf(st))
	}
	delay := min(r.RetryMin<<min(st.FailedIssuanceAttempts-1, 20), r.RetryMax)
	delay = delay/2 + rand.N(delay/2+1) // jitter: failures together do not retry together
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{
		Type: v1alpha1.ConditionIssuing, Status: metav1.ConditionTrue, Reason: reason, ObservedGeneration: mc.Generation,
		Message: fmt.Sprintf("attempt %d failed: %v; retrying in %s", st.FailedIssuanceAttempts, cause, delay.Round(time.Second/10)),
	})
	r.Events.Eventf(mc, nil, corev1.EventTypeWarning, reason, "Issue", "Issuance failed (attempt %d; retrying in %s): %v", st.FailedIssuanceAttempts, delay.Round(time.Second/10), cause)
	r.Logger.Warn("issuance failed", "namespace", mc.Namespace, "name", mc.Name, "reason", reason, "attempt", st.FailedIssuanceAttempts, "retry_in", delay, "error", cause)
	if err := r.Client.Status().Update(ctx, mc); err != nil && !apierrors.IsConflict(err) {
		return reconcile.Result{}, err
	}
	return reconcile.Result{RequeueAfter: delay}, nil
}

// finalize revokes a deleted resource's certificate (its policy
// permitting) and lets it go.
func (r *Reconciler) finalize(ctx context.Context, mc *v1alpha1.ManagedCertificate) (reconcile.Result, error) {
	if !controllerutil.ContainsFinalizer(mc, finalizer) {
		return reconcile.Result{}, nil
	}
	w, _ := wantedOf(mc)
	if w.revocation != v1alpha1.RevokeNever {
		iss, err := r.Issuers.forRef(ctx, mc.Namespace, mc.Spec.IssuerRef.URL, mc.Spec.IssuerRef.CABundle, mc.Spec.IssuerRef.SecretName)
		serials := slices.Clone(mc.Status.PendingRevocations)
		if mc.Status.SerialNumber != "" {
			serials = appendSet(serials, mc.Status.SerialNumber)
		}
		if s, _ := r.secret(ctx, mc); s != nil && s.Annotations[annotationSerial] != "" {
			serials = appendSet(serials, s.Annotations[annotationSerial])
		}
		if len(serials) > 0 {
			if err != nil {
				if _, offline := iss.(*offline); !offline {
					return r.fail(ctx, mc, nil, err)
				}
			}
			if _, offline := iss.(*offline); !offline {
				for _, serial := range serials {
					if !r.revoke(ctx, mc, iss, serial, "cessationOfOperation", "the ManagedCertificate was deleted") {
						r.Metrics.issuanceError(mc.Namespace, mc.Name, "RevocationFailed")
						return reconcile.Result{RequeueAfter: r.RetryMin}, nil
					}
				}
			}
		}
	}
	r.Metrics.forget(mc.Namespace, mc.Name)
	controllerutil.RemoveFinalizer(mc, finalizer)
	return reconcile.Result{}, client.IgnoreNotFound(r.Client.Update(ctx, mc))
}

// retryRevocations revokes what earlier attempts could not.
func (r *Reconciler) retryRevocations(ctx context.Context, mc *v1alpha1.ManagedCertificate, iss issuer) {
	var left []string
	for _, serial := range mc.Status.PendingRevocations {
		if !r.revoke(ctx, mc, iss, serial, "superseded", "retried") {
			left = append(left, serial)
		}
	}
	mc.Status.PendingRevocations = left
}

// revoke revokes one certificate, reporting it as an event; false when
// the CA server could not be told (to be retried).
func (r *Reconciler) revoke(ctx context.Context, mc *v1alpha1.ManagedCertificate, iss issuer, serial, reason, why string) bool {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err := iss.revoke(ctx, serial, reason)
	switch {
	case errors.Is(err, errNoRevocation):
		return true
	case err != nil:
		r.Events.Eventf(mc, nil, corev1.EventTypeWarning, "RevocationFailed", "Revoke", "Revoking serial %s (%s) failed, retrying: %v", serial, why, err)
		r.Logger.Warn("revocation failed", "namespace", mc.Namespace, "name", mc.Name, "serial", serial, "error", err)
		return false
	}
	r.Metrics.revoked()
	r.Events.Eventf(mc, nil, corev1.EventTypeNormal, "Revoked", "Revoke", "Revoked serial %s at %s (%s: %s)", serial, iss, reason, why)
	r.Logger.Info("revoked", "namespace", mc.Namespace, "name", mc.Name, "serial", serial, "reason", reason, "why", why)
	return true
}

// secret reads the resource's Secret (nil when there is none); a Secret
// of that name that belongs to another ManagedCertificate is an error.
func (r *Reconciler) secret(ctx context.Context, mc *v1alpha1.ManagedCertificate) (*corev1.Secret, error) {
	s := &corev1.Secret{}
	err := r.Reader.Get(ctx, types.NamespacedName{Namespace: mc.Namespace, Name: mc.Spec.SecretName}, s)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if owner, ok := s.Labels[labelCertificate]; ok && owner != mc.Name {
		return nil, &issuerError{ReasonSecretInUse, fmt.Errorf("the Secret %s belongs to ManagedCertificate %s: give this one another secretName", s.Name, owner)}
	}
	return s, nil
}

// desiredSecret is the Secret's metadata as it should be: the template's
// labels and annotations, the operator's, and the owner reference.
func (r *Reconciler) desiredSecret(mc *v1alpha1.ManagedCertificate, existing *corev1.Secret) *corev1.Secret {
	s := &corev1.Secret{}
	if existing != nil {
		s = existing.DeepCopy()
	}
	s.Namespace, s.Name, s.Type = mc.Namespace, mc.Spec.SecretName, corev1.SecretTypeTLS
	if s.Labels == nil {
		s.Labels = map[string]string{}
	}
	if s.Annotations == nil {
		s.Annotations = map[string]string{}
	}
	if t := mc.Spec.SecretTemplate; t != nil {
		maps.Copy(s.Labels, t.Labels)
		maps.Copy(s.Annotations, t.Annotations)
	}
	s.Labels[labelCertificate] = mc.Name
	_ = controllerutil.SetControllerReference(mc, s, r.Client.Scheme())
	return s
}

// keepSecretMeta puts back the template's metadata and the owner
// reference on a Secret whose certificate is fine.
func (r *Reconciler) keepSecretMeta(ctx context.Context, mc *v1alpha1.ManagedCertificate, s *corev1.Secret) error {
	want := r.desiredSecret(mc, s)
	if maps.Equal(want.Labels, s.Labels) && maps.Equal(want.Annotations, s.Annotations) && slices.EqualFunc(want.OwnerReferences, s.OwnerReferences, func(a, b metav1.OwnerReference) bool { return a.UID == b.UID }) {
		return nil
	}
	return r.Client.Update(ctx, want)
}

// writeSecret creates or updates the Secret in one write (so that a pod
// mounting it sees the new files together); a Secret of another type is
// replaced, the type being immutable.
func (r *Reconciler) writeSecret(ctx context.Context, existing, desired *corev1.Secret) error {
	if existing != nil && existing.Type != corev1.SecretTypeTLS {
		if err := r.Client.Delete(ctx, existing, client.Preconditions{ResourceVersion: &existing.ResourceVersion}); err != nil {
			return err
		}
		existing = nil
		desired.ResourceVersion = ""
	}
	if existing == nil {
		desired.ResourceVersion = ""
		return r.Client.Create(ctx, desired)
	}
	return r.Client.Update(ctx, desired)
}

// issuedSerial is the serial this resource last issued: its status's, or
// the one the operator wrote on the Secret (a status lost to a conflict).
func issuedSerial(mc *v1alpha1.ManagedCertificate, s *corev1.Secret) string {
	if mc.Status.SerialNumber != "" {
		return mc.Status.SerialNumber
	}
	if s != nil {
		return s.Annotations[annotationSerial]
	}
	return ""
}

func appendSet(s []string, v string) []string {
	if slices.Contains(s, v) {
		return s
	}
	return append(s, v)
}

func notAfterOf(st *v1alpha1.ManagedCertificateStatus) time.Time {
	if st.NotAfter == nil {
		return time.Time{}
	}
	return st.NotAfter.Time
}

func renewalOf(st *v1alpha1.ManagedCertificateStatus) time.Time {
	if st.RenewalTime == nil {
		return time.Time{}
	}
	return st.RenewalTime.Time
}

// statusEqual compares statuses ignoring conditions' transition times.
func statusEqual(a, b *v1alpha1.ManagedCertificateStatus) bool {
	x, y := a.DeepCopy(), b.DeepCopy()
	for _, st := range []*v1alpha1.ManagedCertificateStatus{x, y} {
		for i := range st.Conditions {
			st.Conditions[i].LastTransitionTime = metav1.Time{}
		}
	}
	return equality.Semantic.DeepEqual(x, y)
}
