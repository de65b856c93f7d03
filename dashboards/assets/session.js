// An ended console session (expired, logged out elsewhere, console restarted) answers 401 to every
// callback: take the browser to the login page instead of leaving a stale page that no longer refreshes.
(function () {
  const originalFetch = window.fetch;
  window.fetch = function (resource, init) {
    return originalFetch.call(this, resource, init).then(function (response) {
      const url = typeof resource === "string" ? resource : (resource && resource.url) || "";
      if (response.status === 401 && url.indexOf("_dash-update-component") !== -1) {
        window.location.assign("/login");
      }
      return response;
    });
  };
})();
